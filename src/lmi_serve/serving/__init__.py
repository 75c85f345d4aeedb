"""Models behind the routes: the registry, each model's service and job queue, and handler loading."""
