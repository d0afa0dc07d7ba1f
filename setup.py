"""The C/C++ extensions; everything else is declared in pyproject.toml.

Each is optional: a machine without a compiler still installs, and the
layer that loads it falls back to Python loops (slower, same results).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # The batched copy loop (copy/_native.py; without it, Python loops).
        Extension("tensorferry.copy._memcpy", ["src/tensorferry/copy/_memcpy.c"], extra_compile_args=["-O2"],
                  optional=True),
        # Delta plans' compare-and-encode and apply (plans/_delta.py; without
        # it a delta plan sends the whole object every put).
        Extension("tensorferry.plans._diff", ["src/tensorferry/plans/_diff.c"], extra_compile_args=["-O2"],
                  optional=True),
        # Kept plans' per-tensor checks as C++ loops (tensors.data_ptrs falls
        # back to map() over Python's data_ptr without it).
        Extension("tensorferry.tensors._ptrs", ["src/tensorferry/tensors/_ptrs.cpp"], extra_compile_args=["-O2"],
                  optional=True),
        # The monitor's tick over processes that stand still (monitor/_procfs_many.py;
        # without it, the same loop in Python).
        Extension("tensorferry.monitor._still", ["src/tensorferry/monitor/_still.c"], extra_compile_args=["-O2"],
                  optional=True),
    ],
)
