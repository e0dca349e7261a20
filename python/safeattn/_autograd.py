"""Autograd registrations (``torch.library.register_autograd``) of the differentiable ops.

``sdpa_mask`` has no gradient: its Autograd kernel is PyTorch's not-implemented fallback,
registered in C++ (csrc/ops/sdpa_mask.cpp).
"""
