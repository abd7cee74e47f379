"""Opaque ops for the compiled forward at the dispatcher's cost, not ``custom_op``'s.

``torch.library.custom_op`` wraps its function in autograd, ``ADInplaceOrView`` and checking
layers: measured here (torch 2.13, one thread), a call costs about 9 us more than the function
it wraps, and the compiled decode step makes ~150 such calls (every prepacked GEMM, every
layer's paged attention). An op defined on a ``torch.library.Library`` fragment with one
``CompositeExplicitAutograd`` kernel costs about 2 us: the forward is inference only (no
autograd formula is needed), and inductor still sees a fake implementation for shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable[..., object])

NAMESPACE = "pdserve"
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")  # lives as long as the process


def light_op(name: str, schema: str, fake: Callable[..., object]) -> Callable[[F], F]:
    """Decorator: define ``torch.ops.pdserve.<name>`` with ``schema`` (the argument list and
    return, e.g. ``"(Tensor x) -> Tensor"``), the decorated function as its kernel for every
    backend (CPU, oneDNN's opaque tensors, CUDA), and ``fake`` as its shape function for
    ``torch.compile``. The function is returned unchanged. No autograd: calling it on tensors
    that require grad and then back-propagating raises. Raises ``RuntimeError`` when the name
    is already defined in this process."""

    def wrap(fn: F) -> F:
        _LIB.define(name + schema)
        _LIB.impl(name, fn, "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIB)
        return fn

    return wrap
