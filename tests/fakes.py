"""Stand-ins several test files share: kernel costs for a described network, and a layer
whose forward pass sleeps instead of computing."""

import time

from torch import nn

from pipesgd.timing import KernelCosts

KERNELS = {
    "trunc16": KernelCosts(encode=1e-10, decode_add_encode=3e-10, decode=2e-10,
                           decode_add_encode_decode=4e-10),
    "quant8": KernelCosts(encode=2e-10, decode_add_encode=5e-10, decode=1e-10,
                          decode_add_encode_decode=3e-10),
}


class Asleep(nn.Module):
    """Sleeps 5 ms per forward: wall time without CPU time."""

    def forward(self, x):
        time.sleep(5e-3)
        return x
