"""The cluster twin: the real trainer (controller, loops, admission, weight sync, supervision, journal) on a real
Ray, against simulated GPU workers whose costs come from a profile (docs/scale.md).

``JobConfig.twin`` (:class:`TwinConfig`) switches it on; :func:`load_profile` reads a profile
(:data:`PROFILES` are shipped).
"""

from asyncrl.pipelines.twin.profile import PROFILES, Profile, ProfileError, TwinConfig, dump_profile, load_profile

__all__ = ["PROFILES", "Profile", "ProfileError", "TwinConfig", "dump_profile", "load_profile"]
