"""kerasdist's built-in plugins, installed as the ``kerasdist_plugins`` package.

Each module is one plugin, found through the ``kerasdist`` entry-point group
exactly like a third-party plugin.
"""
