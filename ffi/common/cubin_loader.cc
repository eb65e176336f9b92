#include "common/cubin_loader.h"

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <mutex>
#include <sstream>

#include "common/sha256.h"

namespace jax_sparse_mla {
namespace {

std::mutex package_dir_mutex;
std::string& PackageDir() {
  static std::string dir;
  return dir;
}

std::string Env(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

// "a//b/./c" -> "a/b/c": FlashInfer joins "<artifact path>/" + "/" + "<kernel>.cubin".
std::string NormalisePath(const std::string& path) {
  std::string out = !path.empty() && path[0] == '/' ? "/" : "";
  std::istringstream parts(path);
  std::string part;
  bool first = true;
  while (std::getline(parts, part, '/')) {
    if (part.empty() || part == ".") continue;
    if (!first) out += '/';
    out += part;
    first = false;
  }
  return out;
}

std::string Join(const std::string& dir, const std::string& relative) {
  if (dir.empty()) return relative;
  return dir.back() == '/' ? dir + relative : dir + "/" + relative;
}

}  // namespace

void SetCubinPackageDir(const std::string& dir) {
  std::lock_guard<std::mutex> lock(package_dir_mutex);
  PackageDir() = dir;
}

std::vector<std::string> CubinSearchDirs() {
  std::vector<std::string> dirs;
  const std::string env_dir = Env("FLASHINFER_CUBIN_DIR");
  if (!env_dir.empty()) dirs.push_back(env_dir);
  {
    std::lock_guard<std::mutex> lock(package_dir_mutex);
    if (!PackageDir().empty()) dirs.push_back(PackageDir());
  }
  std::string base = Env("FLASHINFER_WORKSPACE_BASE");
  if (base.empty()) base = Env("HOME");
  if (!base.empty()) dirs.push_back(Join(base, ".cache/flashinfer/cubins"));
  return dirs;
}

bool ResolveCubin(const std::string& relative_path, const std::string& sha256, std::string* data,
                  std::string* error) {
  const std::string relative = NormalisePath(relative_path);
  const bool check = Env("FLASHINFER_CUBIN_CHECKSUM_DISABLED").empty();
  std::ostringstream tried;
  const std::vector<std::string> dirs = CubinSearchDirs();
  for (const std::string& dir : dirs) {
    const std::string path = Join(dir, relative);
    std::ifstream file(path, std::ios::binary);
    if (!file) {
      tried << "\n  " << path << " (missing)";
      continue;
    }
    std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
    if (file.bad()) {
      tried << "\n  " << path << " (unreadable)";
      continue;
    }
    if (check) {
      const std::string actual = Sha256Hex(bytes.data(), bytes.size());
      if (actual != sha256) {
        tried << "\n  " << path << " (sha256 " << actual << ", expected " << sha256 << ")";
        continue;
      }
    }
    *data = std::move(bytes);
    return true;
  }
  std::ostringstream message;
  message << "FlashInfer cubin " << relative << " (sha256 " << sha256
          << ") was not found; jax_sparse_mla never downloads kernels. Looked at:";
  if (dirs.empty()) message << "\n  (no folder: FLASHINFER_CUBIN_DIR and HOME are unset)";
  message << tried.str()
          << "\nPut FlashInfer's cubins in one of these folders (e.g. run `flashinfer "
             "download-kernels` on a machine with network access and copy "
             "~/.cache/flashinfer/cubins), or point FLASHINFER_CUBIN_DIR at them.";
  *error = message.str();
  return false;
}

}  // namespace jax_sparse_mla
