"""cc_header_library: headers with an explicit choice of -I and -isystem directories.

cc_library's `includes` always become -isystem; FlashInfer's vendored CCCL must be -I so that it
wins over the CUDA toolkit's copy, which nvcc itself adds with -I (ffi/CMakeLists.txt does the same).
Directories are relative to the package of the rule.
"""

def _dirs(ctx, dirs):
    base = ctx.label.workspace_root
    if ctx.label.package:
        base = (base + "/" + ctx.label.package) if base else ctx.label.package
    return [(base + "/" + d) if base else d for d in dirs]

def _cc_header_library_impl(ctx):
    compilation_context = cc_common.create_compilation_context(
        headers = depset(ctx.files.hdrs),
        includes = depset(_dirs(ctx, ctx.attr.includes)),
        system_includes = depset(_dirs(ctx, ctx.attr.system_includes)),
    )
    return [
        DefaultInfo(files = depset(ctx.files.hdrs)),
        CcInfo(compilation_context = compilation_context),
    ]

cc_header_library = rule(
    implementation = _cc_header_library_impl,
    attrs = {
        "hdrs": attr.label_list(allow_files = True),
        "includes": attr.string_list(doc = "Directories passed with -I, searched first."),
        "system_includes": attr.string_list(doc = "Directories passed with -isystem."),
    },
    provides = [CcInfo],
)
