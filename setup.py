"""Only what setup.cfg cannot say declaratively: ship metaseq_oneload.pth.

``metaseq-train +oneload=auto`` needs code to run before metaseq's argparse sees the
command line, without editing metaseq. A ``.pth`` file at the top of site-packages is the
one place Python runs such code at start-up (metaseq_oneload.pth: one cheap check, nothing
imported unless +oneload= or METASEQ_ONELOAD is there). setuptools has no declarative option
for a file outside every package (package_data and data_files cannot place one in
site-packages), so build_py copies it: into build_lib for wheels, and into the editable
wheel's root for ``pip install -e .``. Everything else is in setup.cfg.
"""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

PTH = "metaseq_oneload.pth"


class build_py_with_pth(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            # editable_wheel points install_lib at the root of the wheel it builds.
            target = self.get_finalized_command("install").install_lib
        else:
            target = self.build_lib
        source = os.path.join(os.path.dirname(os.path.abspath(__file__)), PTH)
        self.copy_file(source, os.path.join(target, PTH), preserve_mode=0)

    def get_outputs(self, include_bytecode=1):
        outputs = super().get_outputs(include_bytecode)
        if getattr(self, "editable_mode", False):  # written straight into the wheel, see run()
            return outputs
        return outputs + [os.path.join(self.build_lib, PTH)]


setup(cmdclass={"build_py": build_py_with_pth})
