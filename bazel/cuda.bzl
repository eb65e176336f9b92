"""cuda_library: a CMake CUDA library (.cu files through nvcc, .cc files through gcc) for Bazel.

A small stand-in for rules_cuda's cuda_library (jaxlib's kernel libraries), which cannot be fetched
offline. Each .cu source becomes one `nvcc -c` action with the flags of ffi/CMakeLists.txt
(-Xcompiler=-fPIC -std=c++17, the given -gencode targets, copts, local_defines, includes) and the
include directories, defines and headers of `deps` (CcInfo). The host compiler is the C++
toolchain's (-ccbin), so kernels and handlers are compiled by the same gcc. The objects (no
relocatable device code, so no device-link step) and the library's C++ sources go into one
cc_library that links statically into dependents, as a CMake STATIC library mixing both would.
"""

load("@bazel_tools//tools/cpp:toolchain_utils.bzl", "find_cpp_toolchain")

def _gencode(target):
    # "90a" -> machine code for sm_90a only (no PTX): -gencode=arch=compute_90a,code=sm_90a.
    if target.startswith("sm_") or target.startswith("compute_"):
        fail("gpu_targets entries look like 90a (as CMake's), got %r" % target)
    return "-gencode=arch=compute_%s,code=sm_%s" % (target, target)

def _dirs(ctx, dirs):
    # Package-relative directories -> paths from the execution root.
    base = "/".join([p for p in (ctx.label.workspace_root, ctx.label.package) if p])
    return [(base + "/" + d) if base else d for d in dirs]

def _cuda_objects_impl(ctx):
    cc_toolchain = find_cpp_toolchain(ctx)
    deps_context = cc_common.merge_cc_infos(
        cc_infos = [dep[CcInfo] for dep in ctx.attr.deps],
    ).compilation_context
    inputs = depset(ctx.files.hdrs, transitive = [deps_context.headers])
    tools = depset(transitive = [ctx.attr._nvcc_files.files, cc_toolchain.all_files])
    objects = []
    for src in ctx.files.srcs:
        stem = src.basename[:-len(src.extension) - 1]
        obj = ctx.actions.declare_file("_objs/%s/%s.pic.o" % (ctx.label.name, stem))
        args = ctx.actions.args()
        args.add("-ccbin", cc_toolchain.compiler_executable)
        args.add_all(["-Xcompiler=-fPIC", "-std=c++17"])
        args.add_all([_gencode(t) for t in ctx.attr.gpu_targets])
        args.add_all(ctx.attr.copts)
        args.add_all(_dirs(ctx, ctx.attr.includes), format_each = "-I%s")
        args.add_all(deps_context.defines, format_each = "-D%s")
        args.add_all(ctx.attr.local_defines, format_each = "-D%s")
        args.add_all(deps_context.includes, format_each = "-I%s")
        # (Bazel's -iquote directories, the repository roots, are left out: nvcc has no -iquote,
        # and the sources include their own headers relative to themselves.)
        args.add_all(deps_context.system_includes, before_each = "-isystem")
        args.add("-c", src)
        args.add("-o", obj)
        ctx.actions.run(
            executable = ctx.executable._nvcc,
            arguments = [args],
            inputs = depset([src], transitive = [inputs]),
            tools = tools,
            outputs = [obj],
            mnemonic = "CudaCompile",
            progress_message = "Compiling %s with nvcc (%s)" % (
                src.short_path,
                ", ".join(ctx.attr.gpu_targets),
            ),
            use_default_shell_env = True,
        )
        objects.append(obj)
    return [DefaultInfo(files = depset(objects))]

_cuda_objects = rule(
    implementation = _cuda_objects_impl,
    attrs = {
        "srcs": attr.label_list(allow_files = [".cu"]),
        "hdrs": attr.label_list(allow_files = True),
        "deps": attr.label_list(providers = [CcInfo]),
        "gpu_targets": attr.string_list(mandatory = True),
        "copts": attr.string_list(),
        "local_defines": attr.string_list(),
        "includes": attr.string_list(),
        "_nvcc": attr.label(
            default = Label("@local_config_cuda//:cuda/bin/nvcc"),
            allow_single_file = True,
            executable = True,
            cfg = "host",
        ),
        "_nvcc_files": attr.label(default = Label("@local_config_cuda//:nvcc_files")),
        "_cc_toolchain": attr.label(default = Label("@bazel_tools//tools/cpp:current_cc_toolchain")),
    },
    toolchains = ["@bazel_tools//tools/cpp:toolchain_type"],
    fragments = ["cpp"],
)

def cuda_library(
        name,
        srcs,
        gpu_targets,
        hdrs = [],
        deps = [],
        copts = [],
        cc_copts = [],
        local_defines = [],
        includes = [],
        **kwargs):
    """A static library of nvcc-compiled .cu files and gcc-compiled .cc files, as a cc_library.

    Args:
      name: the cc_library (the nvcc objects are the rule `name`_objects).
      srcs: .cu files (one nvcc action each) and .cc/.cpp files (compiled by the C++ toolchain).
      gpu_targets: e.g. ["90a"]; each becomes -gencode=arch=compute_X,code=sm_X.
      hdrs: headers of these sources (exported by the cc_library), stub headers included.
      deps: CcInfo targets whose headers, include dirs and defines the sources see; linked into
        dependents.
      copts: extra nvcc flags (CMake's $<$<COMPILE_LANGUAGE:CUDA>:...> options).
      cc_copts: extra flags of the .cc files (CMake's $<$<COMPILE_LANGUAGE:CXX>:...> options).
      local_defines: -D flags of this library's sources (both languages; CMake PRIVATE).
      includes: package-relative directories passed with -I to this library's sources only.
      **kwargs: passed to the cc_library (visibility, tags, ...).
    """
    cu_srcs = [s for s in srcs if s.endswith(".cu")]
    cc_srcs = [s for s in srcs if not s.endswith(".cu")]
    _cuda_objects(
        name = name + "_objects",
        srcs = cu_srcs,
        hdrs = hdrs,
        deps = deps,
        gpu_targets = gpu_targets,
        copts = copts,
        local_defines = local_defines,
        includes = includes,
        visibility = ["//visibility:private"],
        tags = kwargs.get("tags"),
    )
    prefix = "/".join([p for p in (_repository_root(), native.package_name()) if p])
    native.cc_library(
        name = name,
        srcs = [":" + name + "_objects"] + cc_srcs,
        hdrs = hdrs,
        copts = ["-I" + ((prefix + "/" + d) if prefix else d) for d in includes] + cc_copts,
        # cc rules shell-tokenize defines: X="a" must stay quoted for gcc (nvcc gets them verbatim).
        local_defines = [d.replace('"', '\\"') for d in local_defines],
        deps = deps,
        linkstatic = True,
        **kwargs
    )

def _repository_root():
    # "" in the main repository, external/<name> when this workspace is used as @<name>.
    name = native.repository_name().lstrip("@")
    return ("external/" + name) if name else ""
