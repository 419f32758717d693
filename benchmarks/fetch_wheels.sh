#!/usr/bin/env bash
# Downloads into .whl/ the wheels that benchmarks/gpu_check.sh needs on the lent H200 machine
# (Python 3.12, x86-64, no package index; torch, numpy, tensorboard, tqdm, imageio, packaging,
# cloudpickle and an older typing-extensions are already there). Run here, where pip reaches an index,
# from the repository root; running it again downloads nothing new:
#     bash benchmarks/fetch_wheels.sh
# On the device machine:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# The set is the closure of gymnasium[mujoco] and tyro minus what the machine holds, except
# mujoco-studio (and its websockets): the `mujoco` 4 wheel names it, but it is only the Studio
# viewer and Filament renderer, which nothing here imports, and it is the largest wheel by far.
# Every version matches what this project is developed against (pip show here).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

WHEELS=(
    gymnasium==1.4.0
    farama-notifications==0.0.6   # gymnasium
    mujoco==4.0.0                 # gymnasium[mujoco]; a thin package over mujoco-core
    mujoco-core==4.0.0            # the bindings and libmujoco
    glfw==2.11.0                  # imported by gymnasium.envs.mujoco.mujoco_rendering
    pyopengl==3.1.10              # mujoco's GL contexts (MUJOCO_GL=egl|osmesa)
    tyro==1.0.17
    docstring-parser==0.18.0      # tyro
    typeguard==4.6.1              # tyro
    typing-extensions==4.15.0     # typeguard 4.6 needs >= 4.14, tyro >= 4.13, gymnasium >= 4.12:
)                                 # newer than the image's may be, so it travels too
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

exclude=.git/info/exclude
mkdir -p .git/info .whl
grep -qxF /.whl/ "$exclude" 2>/dev/null || echo /.whl/ >> "$exclude"

plat_args=()
for p in "${PLATFORMS[@]}"; do plat_args+=(--platform "$p"); done
for spec in "${WHEELS[@]}"; do
    name=${spec%%==*}; version=${spec#*==}
    # wheel file names spell the project name with underscores, sometimes with capitals
    if ls .whl | grep -qiE "^$(echo "$name" | tr - _)-$version-.*\.whl$"; then
        continue
    fi
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${plat_args[@]}" -d .whl "$spec"
done

# one version of each project: a second stops the whole install on the device
dupes=$(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z' 'a-z' | sort | uniq -d)
if [ -n "$dupes" ]; then
    echo "more than one wheel of: $dupes (remove the stale ones from .whl/)" >&2
    exit 1
fi
ls -l .whl/*.whl | awk '{print $5, $9}'
du -ch .whl/*.whl | tail -1
