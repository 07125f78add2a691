"""A trained model put to use: save / load (any world size), eval, predict, serving export.

Above ``train`` in the layers: it reads models written by the trainer and builds the unsharded
``DLRM``; the serving artifact's loader (``standalone.py``, copied as ``serving.py``) imports only
torch and numpy.
"""

from neorec.serve.model import find_model_dir, load_model, save_model

__all__ = ["save_model", "load_model", "find_model_dir"]
