"""Ships the top-level catalog.yaml and templates/ inside the wheel (as planner/catalog.yaml and
planner/templates/), so a non-editable `pip install .` plans and renders like a checkout does."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildWithData(build_py):
    def run(self):
        super().run()
        root = Path(__file__).parent
        target = Path(self.build_lib) / "planner"
        target.mkdir(parents=True, exist_ok=True)  # editable builds start from an empty build_lib
        self.copy_file(str(root / "catalog.yaml"), str(target / "catalog.yaml"))
        (target / "templates").mkdir(parents=True, exist_ok=True)
        for tpl in sorted((root / "templates").glob("*.j2")):
            self.copy_file(str(tpl), str(target / "templates" / tpl.name))


setup(cmdclass={"build_py": BuildWithData})
