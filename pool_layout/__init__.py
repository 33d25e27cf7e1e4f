"""What the KV pool holds and where each byte goes. Imports torch and the standard library only."""
from .arena import LayerArena
from .fields import EntryField
from .layout import KV_DTYPES, Placement, aligned_empty, carve, place, plan_regions, positive_int, resolve_dtype
from .mha import MhaKvPool
from .planner import PoolPlanner
from .rows import PoolRows

__all__ = ["EntryField", "KV_DTYPES", "LayerArena", "MhaKvPool", "Placement", "PoolPlanner", "PoolRows",
           "aligned_empty", "carve", "place", "plan_regions", "positive_int", "resolve_dtype"]
