"""nanobind_extension: a Python extension module built with nanobind, as jaxlib names it.

Mirrors nanobind_add_module(<name> NB_STATIC NB_DOMAIN <domain> ...) in a Release build
(nanobind/cmake/nanobind-config.cmake): nanobind linked statically (@nanobind), hidden visibility,
-Os without stack protector, section GC and a stripped module. Produces `<name>.so` (an extension
suffix Python imports, like jaxlib's modules) and a py_library `<name>` carrying it as data.
"""

# Compiler flags of every source of a nanobind_add_module() target in a Release build.
NANOBIND_MODULE_COPTS = [
    "-fvisibility=hidden",
    "-fno-stack-protector",
    "-Os",
    "-ffunction-sections",
    "-fdata-sections",
]

def shell_quoted_defines(defines):
    """Defines for cc rules, whose `defines` are shell-tokenized: X="a" must reach gcc quoted."""
    return [d.replace('"', '\\"') for d in defines]

def nanobind_extension(
        name,
        srcs,
        deps = [],
        domain = None,
        local_defines = [],
        copts = [],
        linkopts = [],
        visibility = None,
        **kwargs):
    """Builds the extension module `name` (PyInit_<name>) from nanobind sources.

    Args:
      name: the module name; the shared object is `name`.so.
      srcs: C++ sources holding NB_MODULE(name, m).
      deps: cc_library dependencies, linked statically into the module.
      domain: NB_DOMAIN, isolating this module's nanobind types from other extensions' copies.
      local_defines: -D definitions of these sources (X="a" keeps its quotes).
      copts: extra compiler flags.
      linkopts: extra linker flags.
      visibility: of both targets.
      **kwargs: passed to the cc_binary.
    """
    native.cc_binary(
        name = name + ".so",
        srcs = srcs,
        copts = NANOBIND_MODULE_COPTS + copts,
        local_defines = shell_quoted_defines(
            (["NB_DOMAIN=" + domain] if domain else []) + local_defines,
        ),
        linkopts = ["-Wl,-s", "-Wl,--gc-sections"] + linkopts,
        linkshared = True,
        linkstatic = True,
        deps = deps + [
            "@nanobind",
            "@local_config_python//:headers",
        ],
        visibility = visibility,
        **kwargs
    )
    native.py_library(
        name = name,
        data = [":" + name + ".so"],
        visibility = visibility,
    )
