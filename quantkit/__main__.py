"""`python -m quantkit ...`, which is how torchrun launches it: `torchrun --nproc-per-node N -m quantkit convert ...`."""

from .cli import entry

entry()
