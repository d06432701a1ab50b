"""Hardware agents: one module per device kind."""
