//! The training example learns: a few steps of `examples/train_recall.rs`
//! lower the loss from chance.

#[path = "../examples/train_recall.rs"]
#[allow(dead_code)]
mod example;

#[test]
fn a_few_steps_lower_the_loss() {
    let (_, losses) = example::train(150, 7, |_, _, _| {}).unwrap();
    let mean = |s: &[f32]| s.iter().sum::<f32>() / s.len() as f32;
    let (first, last) = (mean(&losses[..10]), mean(&losses[130..]));
    eprintln!("loss: first 10 steps {first}, last 20 {last}");
    assert!(
        losses.iter().all(|l| l.is_finite()) && last < 0.9 * first,
        "loss did not fall: first 10 steps {first}, last 20 {last}"
    );
}
