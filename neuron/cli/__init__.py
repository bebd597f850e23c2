"""The commands: ``neuron`` itself (``main``), ``serve`` (the leader), a worker, ``generate``, and the docs'
reference pages."""
