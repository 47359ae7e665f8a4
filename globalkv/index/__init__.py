"""Index backends behind one interface."""
