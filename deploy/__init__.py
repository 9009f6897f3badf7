"""Launch sites: Ray worker actors (ray_launch), the one-command local stack (local), and the
cluster configs (ray up, KubeRay) with their README."""
