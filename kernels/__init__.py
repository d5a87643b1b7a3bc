"""The project's own operators (the book's stage 10.4.7, "use a custom operator")."""

from kernels.linear_cross_entropy import linear_cross_entropy

__all__ = ["linear_cross_entropy"]
