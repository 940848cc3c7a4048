"""The front door: the ``vcluster`` command. Only this layer knows every other layer."""
