"""Package discovery: every package under fulmen/, and the top-level folders installed inside the fulmen namespace.

pyproject.toml holds the metadata; the package list is found here because setuptools' `find` cannot map a top-level
folder (strategies/) to a subpackage (fulmen.strategies). A new subpackage is picked up without being listed.
"""

from setuptools import find_packages, setup

# Top-level folders that install as fulmen subpackages, so nothing generic like `strategies` lands in site-packages.
MAPPED = {"fulmen.strategies": "strategies", "fulmen.pretrain": "pretrain", "fulmen.unsloth": "unsloth",
          "fulmen.liger": "liger"}

packages = find_packages(include=["fulmen", "fulmen.*"])
for package, folder in MAPPED.items():
    packages += [package, *(f"{package}.{sub}" for sub in find_packages(folder))]

setup(packages=packages, package_dir=MAPPED)
