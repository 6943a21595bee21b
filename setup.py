"""Package discovery for asyncrl (everything else is in pyproject.toml).

The repository keeps the RL layers at the top level (``roles/``, ``pipelines/``); the
wheel installs them as ``asyncrl.roles`` and ``asyncrl.pipelines``. Every package under
each root is found (``find_packages``), so a new subpackage ships without editing a
list (``tests/core/test_packaging.py`` builds the wheel and checks every module is in it).
"""

from setuptools import find_packages, setup

ROOTS = {"asyncrl": "asyncrl", "asyncrl.roles": "roles", "asyncrl.pipelines": "pipelines"}

packages = []
for name, where in ROOTS.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(where))]

setup(packages=packages, package_dir=ROOTS)
