"""MiTA's landmark operators: pooling the queries into landmarks, the landmark pass (each landmark's
scores against every key and the shared expert's values) and routing to the best landmark.

reference.py        the PyTorch forms
cpu.py              the C kernels (csrc/landmark_cpu.c) as torch.library operators
mita_layer_cpu.py   MiTA's default form (landmarks, routing, grouped attention) as one operator pair
dispatch.py         whether the kernels take the inputs, and why not
"""
from .dispatch import refusals, takes
from .reference import landmark_scores

__all__ = ["landmark_scores", "refusals", "takes"]
