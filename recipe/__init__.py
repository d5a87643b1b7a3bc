"""The trainer's plumbing: processes and devices, metrics, checkpoints, the LR schedule."""

import logging

# torchao (the lowbit extra, which transformers imports too where it is installed) warns for each
# of its compiled libraries that was built for another CUDA or Python, then works without them;
# and torch warns that torchao registers its enums in a way it no longer needs. Neither asks
# anything of the user: silenced for every program, which all import this package.
logging.getLogger("torchao").setLevel(logging.ERROR)
logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
