"""What ucxx is handed for a KV buffer: its bytes, host or CUDA memory, made cheaply (a prompt's
KV is hundreds of pieces, and each one's view is made on the way to the wire)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy

if TYPE_CHECKING:  # the data-plane helper process runs this without torch
    import torch


def ucx_view(tensor: torch.Tensor | numpy.ndarray):
    """What ucxx accepts: host memory through the array interface, CUDA memory through its own."""
    if isinstance(tensor, numpy.ndarray):
        if not tensor.flags.c_contiguous:
            raise ValueError("KV buffers must be contiguous")
        return tensor.reshape(-1).view(numpy.uint8)
    if not tensor.is_contiguous():
        raise ValueError("KV buffers must be contiguous")
    if tensor.is_cuda:
        return CudaBytes(tensor)
    import torch  # a torch tensor: torch is loaded

    # Bytes, not elements (numpy has no bfloat16). Viewing a contiguous tensor as bytes widens
    # its last dimension: no reshape needed, except for a 0-d tensor.
    return (tensor if tensor.dim() else tensor.reshape(1)).view(torch.uint8).numpy()


class CudaBytes:
    """A CUDA tensor's bytes as ucxx reads them. The interface is made here: torch's own
    property checks and converts enough to cost a few microseconds a piece."""

    __slots__ = ("__cuda_array_interface__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor  # its memory stays alive with the view
        self.__cuda_array_interface__ = {
            "shape": (tensor.nbytes,),
            "typestr": "|u1",
            "data": (tensor.data_ptr(), False),
            "strides": None,
            "version": 3,
        }
