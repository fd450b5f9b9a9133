"""Which verl versions this plugin drives, and the one check that refuses the others.

verl changes its worker API between minor versions. Every place this plugin
touches verl was read against the versions in :data:`SUPPORTED`; the
differences among them are handled where they occur (``rollout.py`` for the
rollout servers, ``config.py`` for the engine-worker switch of 0.7). A verl
outside the range is refused at start-up with both versions named, instead of
failing with an ``AttributeError`` inside a step.
"""

from __future__ import annotations

import importlib.metadata

from packaging.specifiers import SpecifierSet
from packaging.version import Version

SUPPORTED = ">=0.7,<0.10"
"""verl releases whose engine workers, registries and rollout servers this plugin was written against."""
SUPPORTED_VERL = SpecifierSet(SUPPORTED)


class UnsupportedVerlError(RuntimeError):
    """The installed verl is missing or outside :data:`SUPPORTED`."""


def installed_verl_version() -> str | None:
    """The version of the installed ``verl`` distribution, or None when it is not installed."""
    try:
        return importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        return None


def verl_version() -> Version:
    """The installed verl version; raises :class:`UnsupportedVerlError` unless it is supported.

    The message names the installed version and the supported range, and
    says what to install.
    """
    installed = installed_verl_version()
    if installed is None:
        raise UnsupportedVerlError(
            f"agl-plugin-verl needs verl {SUPPORTED}, and verl is not installed: "
            f"pip install 'verl{SUPPORTED}'")
    version = Version(installed)
    # Pre-releases of a supported minor version (0.9.0rc1) are accepted: they carry its API.
    if not SUPPORTED_VERL.contains(version, prereleases=True):
        raise UnsupportedVerlError(
            f"agl-plugin-verl supports verl {SUPPORTED}; verl {installed} is installed. "
            f"Install a supported release (pip install 'verl{SUPPORTED}') or an agl-plugin-verl "
            "release written for this verl.")
    return version


def is_verl_0_7(version: Version) -> bool:
    """verl 0.7 differs from 0.8+ in three places this plugin touches.

    Its engine workers sit behind ``trainer.use_legacy_worker_impl=disable``,
    its critic keeps engine settings under ``model.fsdp_config``, and its
    rollout replicas are woken directly rather than through a checkpoint engine.
    """
    return version < Version("0.8")
