"""Teacher side of MLSM: frozen early-exit teacher, dictionary learning, sparse coding."""

from mlsm.teacher.sparse_coding import SparseCodes, fista, kkt_violation, sparse_encode, top_nnz
from mlsm.teacher.teacher import Teacher, default_teacher_path, load_teacher

__all__ = [
    "SparseCodes",
    "Teacher",
    "default_teacher_path",
    "fista",
    "kkt_violation",
    "load_teacher",
    "sparse_encode",
    "top_nnz",
]
