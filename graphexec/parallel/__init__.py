"""More than one process: tensor-parallel ranks over torch.distributed (gloo on CPU, NCCL on CUDA)
and data-parallel replicas behind one server.  The model's sharded layers live in models/; this
room owns process groups, collectives, rank processes and the per-step hand-over from rank 0."""
