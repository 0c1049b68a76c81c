// nccl_memory.cpp — what NCCL's communicator holds on each GPU, outside the caching allocator,
// from NCCL's sources (NVIDIA/nccl @5067397c; the fact sheet's section 4 cites each line).
// The channel counts are what NCCL's logs show on such machines, not a measurement of ours:
// every assumption is printed with the figure.
#include "parallel/nccl_memory.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/allocator/units.hpp"
#include "vramscope/runtime/data_parallel.hpp"

namespace mem::nn {
namespace {

// src/include/device.h, init.cc: the protocols' buffers of one connection.
constexpr std::size_t kSimple = 4 * MiB;                    // NCCL_BUFFSIZE
constexpr std::size_t kLl = 8 * 512 * 8 * 16;               // 512 KiB
constexpr std::size_t kLl128 = 120 * 640 * 8 * 8;           // 4,915,200 B
constexpr std::size_t kIpcGranularity = 2 * MiB;            // CUDA_IPC_MIN (comm.h)
// transport/p2p.cc: the receiver holds LL + LL128 + SIMPLE (with a header), the sender a
// header (SIMPLE moves to it with P2P read, A100 on NVLink: the total stays 12 MiB).
constexpr std::size_t round_ipc(std::size_t n) { return (n + kIpcGranularity - 1) / kIpcGranularity * kIpcGranularity; }
constexpr std::size_t kRingChannelBytes = round_ipc(kLl + kLl128 + kSimple + 4096) + round_ipc(4096);
// transport/nvls.cc: NVLS_CHUNKSIZE 128 KiB x 8 steps, 16 channels on SM90, x 2, per head.
constexpr std::size_t kNvlsHeadBytes = 16 * 2 * 128 * KiB * 8;
// transport/net.cc, one connection to another node with GPUDirect RDMA (the default for
// compute capability 8.0 and newer beside a GDR-capable NIC, graph/paths.cc:460-505): the
// receiver holds LL + LL128 + SIMPLE on the GPU (net.cc:1098-1127), the sender LL128 + SIMPLE
// (LL stays in host memory, net.cc:914-920), each padded to 2 MiB: 10 MiB a side; the headers
// are in host memory. Without GDR every buffer is in pinned host memory.
constexpr std::size_t kNetSideBytes = round_ipc(kLl + kLl128 + kSimple);
constexpr std::size_t kGpusPerNode = 8;

bool data_center(std::string_view name) {
  for (const char* gpu : {"a100", "h100", "h200", "b200", "v100", "A100", "H100", "H200", "B200", "V100"}) {
    if (name.find(gpu) != std::string_view::npos) return true;
  }
  return false;
}

}  // namespace

Topology parse_topology(std::string_view name) {
  if (name == "auto") return Topology::Auto;
  if (name == "nvswitch") return Topology::NvSwitch;
  if (name == "pcie") return Topology::Pcie;
  if (name == "none") return Topology::None;
  throw Error("unknown topology '" + std::string(name) +
              "'; expected nvswitch (8 GPUs per node on NVLink through NVSwitches), pcie, none (leave NCCL's "
              "memory out) or auto (nvswitch for A100, H100, H200, B200 and V100, else pcie)");
}

std::string_view topology_name(Topology topology) noexcept {
  switch (topology) {
    case Topology::Auto: return "auto";
    case Topology::NvSwitch: return "nvswitch";
    case Topology::Pcie: return "pcie";
    case Topology::None: return "none";
  }
  return "?";
}

namespace {

/// One communicator of `size` ranks, `per_node` of them on each node (8 for a flat job; 8 / N
/// for the data-parallel group of a mesh whose N tensor-parallel ranks fill a node's GPUs).
NcclMemory communicator(std::size_t size, std::size_t per_node, Topology topology, int compute_capability) {
  NcclMemory out;
  const std::size_t local = std::min(size, per_node);  // GPUs of this node in the communicator
  const std::size_t channels = topology == Topology::NvSwitch ? 16 : 2;
  out.bytes = channels * kRingChannelBytes;
  std::string what = std::to_string(channels) + " ring channels x " + format_bytes(kRingChannelBytes) +
                     " (a 10 MiB receive buffer and a 2 MiB send header each, transport/p2p.cc)";
  // NVLS (NCCL_NVLS_ENABLE=2, auto): NVSwitch systems of Hopper or newer.
  if (topology == Topology::NvSwitch && compute_capability >= 90 && local > 1) {
    out.bytes += local * kNvlsHeadBytes;
    what += " + NVLS " + std::to_string(local) + " heads x " + format_bytes(kNvlsHeadBytes);
  }
  const std::size_t nodes = (size + per_node - 1) / per_node;
  if (nodes > 1) {
    // Several nodes (net.cc, transport/generic.cc, graph/trees.cc). Per ring channel each
    // node has one link in from the network and one out, replacing one of its P2P links:
    // per GPU, channels / 8 x (a receive and a send side - a P2P receive and send header).
    // The double binary tree (all-reduces) links each node to 4(N-1)/N others on average,
    // each both ways, on half the channels per tree: channels x 4(N-1)/N x a side / 8 per GPU.
    const bool gdr = topology == Topology::NvSwitch;
    const double side = gdr ? static_cast<double>(kNetSideBytes) : 0.0;
    const double c = static_cast<double>(channels), g = static_cast<double>(kGpusPerNode);
    const double n = static_cast<double>(nodes);
    const double ring = c / g * (2 * side - static_cast<double>(kRingChannelBytes));
    const double tree = c * 4 * (n - 1) / n * side / g;
    out.bytes = static_cast<std::size_t>(std::llround(static_cast<double>(out.bytes) + ring + tree));
    what += std::string(", and across ") + std::to_string(nodes) + " nodes" +
            (per_node == kGpusPerNode ? std::string(" of 8") : " of " + std::to_string(per_node) + " in the group") + " (" +
            (gdr ? "GPUDirect RDMA: 10 MiB a side of each network link, transport/net.cc"
                 : "no GPUDirect RDMA: the network links' buffers in host memory") +
            ") the ring's links in and out of the node " + (ring < 0 ? "- " : "+ ") +
            format_bytes(static_cast<std::size_t>(std::llround(std::abs(ring)))) + " and the all-reduce tree's + " +
            format_bytes(static_cast<std::size_t>(std::llround(tree))) + " per GPU on average";
  }
  what += " = " + format_bytes(out.bytes) + " on " + std::string(topology_name(topology)) + " (" +
          std::to_string(channels) + " channels as NCCL's logs show, unmeasured";
  if (nodes > 1) {
    what += "; left out: NVLS-tree's network links, up to 640 MiB on each GPU with a NIC if NCCL's tuner picks it "
            "for an all-reduce, and the tree's links back along the node";
  }
  out.assumptions = what + ")";
  return out;
}

}  // namespace

NcclMemory nccl_memory(const ParallelConfig& config, std::string_view device_name, int compute_capability) {
  NcclMemory out;
  if (!config.enabled() || config.gpus() < 2 || config.topology == Topology::None) return out;
  const Topology topology = config.topology != Topology::Auto ? config.topology
                            : data_center(device_name)         ? Topology::NvSwitch
                                                               : Topology::Pcie;
  // A communicator per process group: the engine's, the context-parallel and the
  // tensor-parallel group's inside a node (DeviceMesh's groups, the inner dimensions on
  // neighbouring GPUs).
  const std::size_t tp = config.tensor_parallel;
  std::vector<std::pair<std::string, NcclMemory>> groups;
  if (config.engine != ParallelEngine::None && config.world_size > 1) {
    groups.emplace_back("the data-parallel group's",
                        communicator(config.world_size, std::max<std::size_t>(kGpusPerNode / tp, 1), topology,
                                     compute_capability));
  }
  if (const std::size_t cp = config.context_parallel; cp > 1) {
    // The ring's own group, the cp dimension of the mesh (FSDP2's dp_shard_cp is another).
    groups.emplace_back("the context-parallel group's",
                        communicator(cp, std::min<std::size_t>(cp, std::max<std::size_t>(kGpusPerNode / tp, 1)),
                                     topology, compute_capability));
  }
  if (const std::size_t ep = config.expert_parallel; ep > 1) {
    // transformers' meshes (distributed/utils.py): the ep group of neighbouring ranks, and the
    // experts' efsdp group (ranks ep apart) when it has more than one.
    groups.emplace_back("the expert-parallel group's", communicator(ep, std::min(ep, kGpusPerNode), topology,
                                                                     compute_capability));
    if (const std::size_t efsdp = config.world_size / ep; efsdp > 1) {
      groups.emplace_back("the experts' FSDP group's",
                          communicator(efsdp, std::max<std::size_t>(kGpusPerNode / ep, 1), topology, compute_capability));
    }
  }
  if (tp > 1) {
    groups.emplace_back("the tensor-parallel group's",
                        communicator(tp, kGpusPerNode, topology, compute_capability));
  }
  if (config.pipeline_parallel > 1 && groups.empty()) {
    // Point-to-point: NCCL connects each pair of neighbouring stages on first send; per channel
    // and peer its P2P transport holds a receive buffer (LL + LL128 + SIMPLE, about 10 MiB) and a
    // send header (2 MiB) (transport/p2p.cc); how many channels a pair gets is not known here.
    out.assumptions = "NCCL's point-to-point connections between neighbouring stages left out (per channel and peer "
                      "about 10 MiB to receive and 2 MiB to send, transport/p2p.cc; the channels per peer are not "
                      "modelled)";
    return out;
  }
  std::string what = groups.size() == 1 ? "NCCL, one communicator, at the first collective: " : "NCCL, at the first collective: ";
  for (std::size_t i = 0; i < groups.size(); ++i) {
    out.bytes += groups[i].second.bytes;
    what += (i > 0 ? "; " : "") + (groups.size() == 1 ? "" : groups[i].first + ": ") + groups[i].second.assumptions;
  }
  if (groups.size() > 1) what += "; " + format_bytes(out.bytes) + " in all";
  if (config.pipeline_parallel > 1) what += "; the point-to-point connections between pipeline stages left out";
  if (config.expert_parallel > 1) {
    what += "; the all-to-alls' point-to-point connections to each peer left out (per channel and peer about 10 MiB "
            "to receive and 2 MiB to send, transport/p2p.cc; NCCL issue 1685 saw a GPU's memory outside PyTorch grow "
            "from 1.06 GB to 4.34 GB at the first all_to_all_single on 8 H100s)";
  }
  out.assumptions = what;
  return out;
}

}  // namespace mem::nn

namespace mem::nn::detail {

void first_collective(Runtime& runtime, const ParallelConfig& config) {
  const DeviceInfo& info = runtime.allocator().device().info();
  const NcclMemory nccl = nccl_memory(config, info.name, info.compute_capability);
  if (nccl.bytes > 0) runtime.allocator().load_module("NCCL's communicator buffers", nccl.bytes);
}

}  // namespace mem::nn::detail
