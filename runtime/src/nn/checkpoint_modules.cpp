// checkpoint_modules.cpp — checkpointing modules over checkpoint(): checkpoint_sequential's
// split, apply_activation_checkpointing by path (marks on modules, and on the containers a
// model file flattened), and the module paths they name.
#include "vramscope/runtime/checkpoint_modules.hpp"

#include <algorithm>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "vramscope/allocator/errors.hpp"

namespace mem::nn {

SegmentPlan plan_segments(std::size_t modules, std::size_t segments) {
  if (segments < 1 || segments > modules) {
    throw Error("checkpoint_sequential: " + std::to_string(segments) + " segments for " + std::to_string(modules) +
                " modules; use 1 to " + std::to_string(modules));
  }
  SegmentPlan plan;
  const std::size_t size = modules / segments;
  for (std::size_t start = 0; start < size * (segments - 1); start += size) {
    plan.checkpointed.emplace_back(start, start + size - 1);
  }
  plan.tail_begin = size * (segments - 1);
  return plan;
}

Tensor checkpoint_sequential(std::span<Module* const> modules, std::size_t segments, const Tensor& input,
                             const CheckpointOptions& options) {
  const SegmentPlan plan = plan_segments(modules.size(), segments);
  // The rerun happens during backward: the segment function owns its module list.
  const auto list = std::make_shared<std::vector<Module*>>(modules.begin(), modules.end());
  Tensor x = input;
  for (const auto& [first, last] : plan.checkpointed) {
    SegmentFunction fn = [list, first = first, last = last](const TensorList& in) {
      Tensor y = in[0];
      for (std::size_t i = first; i <= last; ++i) y = (*(*list)[i])(y);
      return TensorList{y};
    };
    x = checkpoint(fn, TensorList{x}, options)[0];
  }
  for (std::size_t i = plan.tail_begin; i < modules.size(); ++i) x = (*modules[i])(x);
  return x;
}


namespace {

void collect_named(Module& module, std::vector<Module*>& out) {
  for (const auto& [name, child] : module.children()) {
    if (!child->is_inline()) out.push_back(child.get());
    collect_named(*child, out);
  }
}

/// Clears the marks of modules (the wrappers apply_activation_checkpointing adds); inline code's
/// are torch.utils.checkpoint calls written in a forward, which wrapping modules leaves as they are.
void clear_marks(Module& module) {
  if (!module.is_inline()) module.set_checkpoint(CheckpointMark::None);
  if (auto* list = dynamic_cast<Sequential*>(&module)) list->clear_group_checkpoints();
  for (const auto& [name, child] : module.children()) clear_marks(*child);
}

bool inside(const std::string& path, const std::string& outer) {
  return path.size() > outer.size() && path.compare(0, outer.size(), outer) == 0 && path[outer.size()] == '.';
}

/// "layer1, layer2, layer3 (+1 more)": the named modules one level below `prefix` ("" = top).
std::string modules_below(const std::vector<Module*>& named, const std::string& prefix) {
  std::vector<std::string> names;
  for (const Module* m : named) {
    const std::string& p = m->path();
    if (!prefix.empty() && !inside(p, prefix)) continue;
    const std::string rest = prefix.empty() ? p : p.substr(prefix.size() + 1);
    if (rest.find('.') == std::string::npos) names.push_back(p);
  }
  constexpr std::size_t kShown = 8;
  std::string out;
  for (std::size_t i = 0; i < names.size() && i < kShown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > kShown) out += " (+" + std::to_string(names.size() - kShown) + " more)";
  return out.empty() ? "none" : out;
}

}  // namespace

std::vector<Module*> named_modules(Module& root) {
  std::vector<Module*> out;
  collect_named(root, out);
  return out;
}

void mark_checkpointed(Module& root, const std::vector<std::string>& paths, CheckpointMode mode) {
  const std::vector<Module*> named = named_modules(root);
  // Hashed both ways: a model file may name a million modules (kMaxModules), and list as many.
  std::unordered_map<std::string_view, Module*> by_path;
  for (Module* m : named) by_path.try_emplace(m->path(), m);
  std::unordered_set<std::string_view> given;
  for (const std::string& path : paths) {
    if (path.empty()) {
      throw Error("checkpoint modules: the root module cannot be checkpointed by path (its output is the "
                  "loss's input); name modules inside it, e.g. " + modules_below(named, ""));
    }
    if (!given.insert(path).second) throw Error("checkpoint modules: '" + path + "' is given twice");
  }
  // Containers a model file flattened into their parent's list ("layer1" of "layer1.0", kept
  // flat for checkpoint_sequential): checkpointed as checkpoint(layer1, x) would.
  std::unordered_map<std::string, Sequential*> groups;
  const auto add_groups = [&](Module* m) {
    if (auto* list = dynamic_cast<Sequential*>(m)) {
      for (const std::string& g : list->groups()) groups.try_emplace(m->path().empty() ? g : m->path() + "." + g, list);
    }
  };
  add_groups(&root);
  for (Module* m : named) add_groups(m);
  std::vector<Module*> chosen;
  std::vector<std::pair<Sequential*, std::string>> chosen_groups;
  for (const std::string& path : paths) {
    for (std::size_t dot = path.find('.'); dot != std::string::npos; dot = path.find('.', dot + 1)) {
      const std::string_view outer = std::string_view(path).substr(0, dot);
      if (given.contains(outer)) {
        throw Error("checkpoint modules: '" + path + "' is inside '" + std::string(outer) +
                    "', which is checkpointed whole; give one of them");
      }
    }
    const auto it = by_path.find(path);
    if (const auto group = groups.find(path); it == by_path.end() && group != groups.end()) {
      const std::string& owner = group->second->path();
      chosen_groups.emplace_back(group->second, owner.empty() ? path : path.substr(owner.size() + 1));
      continue;
    }
    if (it == by_path.end()) {
      // The longest prefix some module's path starts with says where the name went wrong
      // ("layer3" of "layer3.40": a flattened stage's blocks are named "layer3.0", ...).
      std::string prefix = path;
      for (;;) {
        const std::size_t dot = prefix.rfind('.');
        prefix = dot == std::string::npos ? "" : prefix.substr(0, dot);
        if (prefix.empty() ||
            std::any_of(named.begin(), named.end(), [&](const Module* m) { return inside(m->path(), prefix); })) {
          break;
        }
      }
      throw Error("checkpoint modules: no module '" + path + "'; the modules " +
                  (prefix.empty() ? std::string("at the top") : "under '" + prefix + "'") + " are " +
                  modules_below(named, prefix));
    }
    chosen.push_back(it->second);
  }
  clear_marks(root);
  const CheckpointMark mark = mode == CheckpointMode::Reentrant ? CheckpointMark::Reentrant : CheckpointMark::NonReentrant;
  for (Module* m : chosen) m->set_checkpoint(mark);
  for (auto& [list, group] : chosen_groups) list->set_group_checkpoint(group, mark);
}

}  // namespace mem::nn
