"""Pure format plugins: one module per HTTP format, all implementing :class:`base.Format`."""
