"""Process-wide switches of the kernels: huge pages for table buffers, and the compiled C helpers
(id map, row cache bookkeeping, record I/O) against their NumPy / torch fallbacks, which take
bitwise the same decisions. ``neorec.builder.run.apply_system`` sets them from ``[system]``."""

HUGEPAGES = True
"""Table buffers advised ``MADV_HUGEPAGE`` before their first touch (``ops.memory``)."""

NATIVE = True
"""The compiled helpers where a C compiler is available (else the fallbacks, always)."""
