"""The sparse trainable entries and their autograd: experts, dense weights, routers, the loss."""
