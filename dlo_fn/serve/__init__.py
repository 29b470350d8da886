"""DP serving over torch.distributed: requests and faults, the wire protocol, one Engine, outputs, local ranks."""
