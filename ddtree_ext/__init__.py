"""ddtree_ext: exact tree speculative decoding (DDTree over a DFlash draft) for Hugging Face models.

The flow of one round: draft (the DFlash block) -> build (top-K per depth, the tree, its mask) ->
verify (one target forward over the tree; GDN layers through the tree ops) -> walk (accept the
longest path the target agrees with) -> commit (GDN, conv and attention caches take the accepted
path, in place).
"""

from ddtree_ext import ops, reference
from ddtree_ext._loader import build_info

__version__ = "0.1.0"

__all__ = ["build_info", "ops", "reference", "__version__"]
