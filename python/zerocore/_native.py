"""Loads zerocore._C after checking that the running torch is the one it was compiled against.

A C++ extension built against one torch release fails against another with undefined symbols or worse, so
the check runs before the shared library is loaded, from a pure-Python record written at build time.
"""

from __future__ import annotations

import torch

try:
    from . import _build_config
except ImportError as error:  # pragma: no cover - only in a source tree that was never built
    raise ImportError(
        "zerocore's native extension is not built. Install torch first, then from the source tree run "
        "`pip install --no-build-isolation .` (or `-e .` for development)."
    ) from error

if torch.__version__ != _build_config.TORCH_VERSION:
    raise ImportError(
        f"zerocore was built against torch {_build_config.TORCH_VERSION} but torch {torch.__version__} is "
        "installed; the C++ extension only works with the torch it was compiled against. Rebuild zerocore "
        "with `pip install --no-build-isolation --force-reinstall --no-deps .` in this environment, or "
        f"install torch=={_build_config.TORCH_VERSION}."
    )

from . import _C  # noqa: E402  (loaded only after the version check)

__all__ = ["_C", "_build_config"]
