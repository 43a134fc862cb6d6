"""jaxspeed plan --auto: search parallel plans for a cluster."""
