"""kvgen's thread settings reach its own libraries but not the programs it starts (benchmark peers)."""

import os
import subprocess
import sys

CHECK = ("import os, kvgen.threads as t; f = t.foreign_environment(); "
         "print(os.environ['OMP_WAIT_POLICY'], os.environ['GOMP_SPINCOUNT'], f.get('OMP_WAIT_POLICY'), "
         "f.get('GOMP_SPINCOUNT'), f['HOME'] == os.environ['HOME'])")


def run(extra: dict[str, str]) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | extra
    return subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True,
                          check=True).stdout.split()


def test_settings_kvgen_made_are_taken_out_for_other_programs():
    assert run({}) == ["PASSIVE", "30000", "None", "None", "True"]


def test_settings_the_user_made_are_passed_on():
    assert run({"OMP_WAIT_POLICY": "ACTIVE"}) == ["ACTIVE", "30000", "ACTIVE", "None", "True"]
