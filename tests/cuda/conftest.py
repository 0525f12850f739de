"""Without a GPU, Triton kernels run on CPU through Triton's interpreter; the switch must be set
before triton is first imported, which is why it lives here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
