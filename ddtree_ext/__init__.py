"""ddtree_ext: exact tree speculative decoding (DDTree over a DFlash draft) for Hugging Face models.

The flow of one round: draft (the DFlash block) -> build (top-K per depth, the tree, its mask) ->
verify (one target forward over the tree; GDN layers through the tree ops) -> walk (accept the
longest path the target agrees with) -> commit (GDN, conv and attention caches take the accepted
path, in place).
"""

from importlib import metadata as _metadata

from ddtree_ext import ops, reference
from ddtree_ext._loader import build_info
from ddtree_ext.fused import stack_projections, unstack_projections

# Rebinds the name ``generate`` from the submodule to the function: ``ddtree_ext.generate(...)``.
# Import the module's other names with ``from ddtree_ext.generate import ...``.
from ddtree_ext.generate import GenerationStats, generate

try:  # one version, from the installed metadata (pyproject.toml)
    __version__ = _metadata.version("ddtree_ext")
except _metadata.PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "DFlashDraftModel", "GenerationStats", "build_info", "generate", "ops", "reference", "stack_projections",
    "unstack_projections", "__version__",
]


def __getattr__(name):
    # The draft pulls in transformers: load it on first use so that importing the package stays light.
    if name == "DFlashDraftModel":
        from ddtree_ext.draft import DFlashDraftModel

        return DFlashDraftModel
    raise AttributeError(f"module 'ddtree_ext' has no attribute {name!r}")
