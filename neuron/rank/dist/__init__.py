"""The process's one ``mx.distributed`` group, and forgetting it: the only code that touches the group."""
