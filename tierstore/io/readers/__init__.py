"""Readers: batched positional reads of one file into caller memory, several backends."""

from tierstore.io.readers.base import ReadOp, Reader
from tierstore.io.readers.faults import FaultPlan, FaultyReader
from tierstore.io.readers.memory import MemoryReader
from tierstore.io.readers.preadv_pool import PreadvPoolReader
from tierstore.io.readers.choice import chosen_backend, make_reader
from tierstore.io.readers.uring import UringReader

__all__ = ["FaultPlan", "FaultyReader", "MemoryReader", "PreadvPoolReader", "ReadOp", "Reader",
           "UringReader", "chosen_backend", "make_reader"]
