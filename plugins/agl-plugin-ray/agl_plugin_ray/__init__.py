"""agl-plugin-ray: agents run by runner actors on a Ray cluster, fed by the store service over HTTP.

Enable it in a recipe; it then fills the ``collect_rollouts`` slot::

    plugins:
      ray: {}                # a local Ray with 2 actors; or {address: auto, actors_per_node: 4, ...}
"""

from agl_plugin_ray.settings import RayConfig

__all__ = ["RayConfig"]
