use super::*;

/// [`SinkProj::split`] (what a GPU's q/k/v run as) gives the joined projection's outputs, the
/// input's gradient and every weight's accumulated gradient (the CPU's twin of the op).
#[test]
fn split_projections_equal_the_joined_one_with_their_gradients() {
    let dev = Device::Cpu;
    let w1 = Var::randn(0f32, 1.0, (3, 4), &dev).unwrap();
    let w2 = Var::randn(0f32, 1.0, (5, 4), &dev).unwrap();
    let r = Tensor::randn(0f32, 1.0, (6, 8), &dev).unwrap();
    let x = Var::randn(0f32, 1.0, (6, 4), &dev).unwrap();
    let run = |split: bool| {
        let (a, b) = (w1.as_tensor(), w2.as_tensor());
        let sink = GradSink::on_device(&[(&w1, a), (&w2, b)]);
        let joined = SinkProj::new(&sink, &[(a, a), (b, b)]).unwrap().unwrap();
        let y = match split {
            true => {
                let parts: Vec<Tensor> = joined
                    .split()
                    .iter()
                    .map(|p| p.forward(x.as_tensor()).unwrap())
                    .collect();
                Tensor::cat(&parts, 1).unwrap()
            }
            false => joined.forward(x.as_tensor()).unwrap(),
        }; // [6, 8]
        let g = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let gx = g.get(x.as_tensor()).unwrap().flatten_all().unwrap();
        let flat = |t: Option<Tensor>| t.unwrap().flatten_all().unwrap().to_vec1::<f32>();
        (
            y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            gx.to_vec1::<f32>().unwrap(),
            flat(sink.take(&w1).unwrap()).unwrap(),
            flat(sink.take(&w2).unwrap()).unwrap(),
        )
    };
    let (j, s) = (run(false), run(true));
    let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-5);
    assert!(close(&j.0, &s.0), "outputs");
    assert!(close(&j.1, &s.1), "the input's gradient");
    assert!(
        close(&j.2, &s.2) && close(&j.3, &s.3),
        "the weights' gradients"
    );
    assert_eq!(j.2.len(), 12);
}
