"""Code shared by router and worker. Nothing in this package imports torch."""
