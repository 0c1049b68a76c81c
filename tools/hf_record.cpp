// hf_record.cpp — recording a transformers config through the Python exporter (hf_record.hpp).
#include "hf_record.hpp"

#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string_view>
#include <vector>

#include <fmt/format.h>

#include "vramscope/allocator/errors.hpp"
#include "vramscope/models/hf_config.hpp"
#include "vramscope/models/model_file.hpp"

extern char** environ;

namespace mem::tools {

namespace {

std::string read_text(const std::filesystem::path& path, std::size_t limit) {
  std::ifstream in(path, std::ios::binary);
  std::string text(limit, '\0');
  in.read(text.data(), static_cast<std::streamsize>(limit));
  text.resize(static_cast<std::size_t>(in.gcount()));
  return text;
}

/// A private scratch folder, removed with everything in it when this goes.
class Scratch {
 public:
  Scratch() {
    std::string pattern = (std::filesystem::temp_directory_path() / "vramscope-hf-XXXXXX").string();
    if (mkdtemp(pattern.data()) == nullptr) throw Error("--hf-config: cannot make a temporary folder to record in");
    path_ = pattern;
  }
  ~Scratch() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  const std::filesystem::path& path() const noexcept { return path_; }

 private:
  std::filesystem::path path_;
};

/// Runs `argv` (no shell) with stdout and stderr into `log`, PYTHONPATH extended; its exit status.
int run(const std::vector<std::string>& argv, const std::filesystem::path& log) {
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_addopen(&actions, 1, log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  posix_spawn_file_actions_adddup2(&actions, 1, 2);
  std::vector<std::string> env_text;
  for (char** e = environ; *e != nullptr; ++e) {
    if (!std::string_view(*e).starts_with("PYTHONPATH=")) env_text.emplace_back(*e);
  }
  std::string pythonpath = VRAMSCOPE_PYTHON_SOURCE_DIR;
  if (const char* given = std::getenv("PYTHONPATH"); given != nullptr && *given != '\0') {
    pythonpath = std::string(given) + ":" + pythonpath;
  }
  env_text.push_back("PYTHONPATH=" + pythonpath);
  std::vector<char*> args, env;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  for (std::string& e : env_text) env.push_back(e.data());
  env.push_back(nullptr);
  pid_t pid = 0;
  const int spawned = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), env.data());
  posix_spawn_file_actions_destroy(&actions);
  if (spawned != 0) return -1;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) return -1;
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

bool builtin_hf_type(const std::string& path) {
  // A FIFO, a device or a folder is the built-in reader's to refuse (reading would block).
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error)) return true;
  try {
    const std::string type = models::hf_model_type(path);
    return type.empty() || type == "llama" || type == "mistral" || type == "qwen2" || type == "gpt2";
  } catch (const Error&) {
    return true;  // the built-in reader says what is wrong with the file
  }
}

std::shared_ptr<const nn::ModelSource> record_hf_config(const std::string& path, const HfRecording& how) {
  const char* chosen = std::getenv("VRAMSCOPE_PYTHON");
  const std::string python = chosen != nullptr && *chosen != '\0' ? chosen : "python3";
  Scratch scratch;
  const std::filesystem::path out = scratch.path() / "model.json", log = scratch.path() / "export.log";
  const std::string stem = models::hf_name_from_path(path);
  if (isatty(2) != 0) {  // why it takes seconds, for whoever watches; logs keep one line per error
    fmt::print(stderr, "vramscope: {}: recording its operators{} with {} -m vramscope.export ({})\n", path,
               how.compile ? " and its compiled step" : "", python,
               how.compile ? "torch.compile at seven sizes: a minute or more" : "a few seconds");
  }
  std::vector<std::string> argv = {python, "-m", "vramscope.export", "--hf-config", path, "--batch", "2", "--seq", "128",
                                   "--name", stem.empty() ? "config" : stem, "-o", out.string()};
  if (!how.autocast.empty()) argv.insert(argv.end(), {"--amp", how.autocast});
  if (!how.attention.empty()) argv.insert(argv.end(), {"--attn", how.attention});
  if (how.lora > 0) argv.insert(argv.end(), {"--lora", std::to_string(how.lora)});
  if (!how.lora_targets.empty()) argv.insert(argv.end(), {"--lora-targets", how.lora_targets});
  if (!how.checkpoint.empty()) argv.insert(argv.end(), {"--gradient-checkpointing", how.checkpoint});
  if (how.compile) argv.emplace_back("--compile");
  if (how.expert_parallel > 1) argv.insert(argv.end(), {"--expert-parallel", std::to_string(how.expert_parallel)});
  const int status = run(argv, log);
  if (status != 0) {
    std::string said = read_text(log, 4000);
    if (status < 0 || said.find("No module named") != std::string::npos) {
      throw Error(fmt::format("this model_type is not one of the built-in decoders (llama, mistral, qwen2, gpt2), and "
                              "recording it needs a Python with torch, transformers and vramscope ({} could not run "
                              "it); pip install torch transformers, or set VRAMSCOPE_PYTHON", python));
    }
    while (!said.empty() && (said.back() == '\n' || said.back() == ' ')) said.pop_back();
    std::replace(said.begin(), said.end(), '\n', ' ');
    throw Error("not one of the built-in decoders (llama, mistral, qwen2, gpt2), and the exporter could not record "
                "it: " + said);
  }
  // Named by the config it came from ("hf:config.json"): messages about it say --hf-config.
  return models::ModelFile::parse(read_text(out, models::kMaxModelFileBytes), "hf:" + path);
}

}  // namespace mem::tools
