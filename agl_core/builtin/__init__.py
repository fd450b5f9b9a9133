"""Plugins that ship with agl_core. They are entry points of the agl-core
distribution and use the same hooks as any third-party plugin."""
