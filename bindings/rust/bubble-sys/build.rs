// Links libbubble. BUBBLE_LIB_DIR names the directory holding libbubble.so (a CMake build
// tree's capi/ directory, or an install's lib/); without it, pkg-config is asked, then the
// linker's default search path is used.
use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=BUBBLE_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-changed=src/bindings.rs");

    let dir = env::var("BUBBLE_LIB_DIR").ok().filter(|d| !d.is_empty()).or_else(|| {
        let out = Command::new("pkg-config").args(["--libs-only-L", "bubble"]).output().ok()?;
        let text = String::from_utf8(out.stdout).ok()?;
        text.split_whitespace().find_map(|f| f.strip_prefix("-L")).map(str::to_owned)
    });
    if let Some(dir) = &dir {
        println!("cargo:rustc-link-search=native={dir}");
        // Dependents read this as DEP_BUBBLE_LIB_DIR, e.g. to set an rpath for their binaries.
        println!("cargo:lib_dir={dir}");
    }
    println!("cargo:rustc-link-lib=dylib=bubble");
}
