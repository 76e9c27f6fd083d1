// Lets this crate's own tests find libbubble at run time without LD_LIBRARY_PATH.
fn main() {
    println!("cargo:rerun-if-env-changed=BUBBLE_LIB_DIR");
    if let Ok(dir) = std::env::var("DEP_BUBBLE_LIB_DIR") {
        println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{dir}");
    }
}
