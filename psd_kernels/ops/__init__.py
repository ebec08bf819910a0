"""Triton kernels and their launchers, one module per kernel family.

``top1`` (vocabulary reduction), ``draft`` (rank / draft on the block) and
``sparse_attn`` (shared-prefix block-sparse attention). Importing any of them imports triton;
the package root never does unless the Triton backend is used. They live in ``ops/`` rather
than beside ``__init__.py`` because a submodule named ``psd_kernels.top1`` would replace the
function ``psd_kernels.top1`` on first import.
"""
