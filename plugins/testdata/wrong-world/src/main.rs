//! A WASI command: exports `wasi:cli/run`, not the wasmctrl reconciler.

fn main() {
    println!("I am not a reconcile plugin");
}
