"""Where embedding rows live (MTrainS): DRAM and SSD row stores and a row cache in front."""
